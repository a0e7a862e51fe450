"""The error tree maps to codes and HTTP statuses in one table and survives a round trip."""

from __future__ import annotations

from trims import errors


def test_every_error_has_a_unique_code() -> None:
    classes = errors._all_subclasses(errors.TrimsError)
    assert len({c.code for c in classes}) == len(classes)


def test_round_trip_keeps_class_message_and_details() -> None:
    e = errors.ResourceExhausted("cpu tier full", budget=10, needed=20)
    back = errors.error_from_dict(e.to_dict())
    assert type(back) is errors.ResourceExhausted
    assert back.message == "cpu tier full"
    assert back.details == {"budget": 10, "needed": 20}
    assert back.retryable


def test_unknown_code_degrades_to_the_root() -> None:
    back = errors.error_from_code("martian", "??")
    assert type(back) is errors.TrimsError


def test_http_statuses_follow_what_the_caller_should_do() -> None:
    assert errors.HTTP_STATUS["queue_full"] == 429
    assert errors.HTTP_STATUS["timeout"] == 504
    assert errors.HTTP_STATUS["upstream"] == 502
    assert errors.HTTP_STATUS["too_large"] == 413
    assert errors.HTTP_STATUS["unauthorized"] == 401
    assert errors.HTTP_STATUS["permission_denied"] == 403
    assert all(
        issubclass(c, errors.RetryableError) == c.retryable
        for c in errors._all_subclasses(errors.TrimsError)
    )

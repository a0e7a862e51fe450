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


def test_error_for_status_says_what_a_remote_refusal_means() -> None:
    from trims.errors import (
        AlreadyExists,
        NotFound,
        PermissionDenied,
        Unavailable,
        UpstreamError,
        ValidationError,
        error_for_status,
    )

    expected = {
        404: NotFound, 410: NotFound, 401: PermissionDenied, 403: PermissionDenied,
        409: AlreadyExists, 408: Unavailable, 429: Unavailable, 500: Unavailable,
        503: Unavailable, 400: ValidationError, 422: ValidationError, 302: UpstreamError,
    }  # fmt: skip
    assert {s: error_for_status(s) for s in expected} == expected


def test_mapped_errors_translates_the_first_matching_row_only() -> None:
    import pytest

    from trims.errors import ErrorMap, NotFound, Unavailable, ValidationError, mapped_errors

    class Remote(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(f"status {status}")
            self.status = status

    table = (
        ErrorMap(Remote, NotFound, "{action}: gone ({detail})", when=lambda e: e.status == 404),
        ErrorMap(Remote, Unavailable, "{action}: try later ({detail})"),
    )
    with (
        pytest.raises(NotFound, match=r"read x: gone \(status 404\)") as info,
        mapped_errors("read x", table),
    ):
        raise Remote(404)
    assert isinstance(info.value.__cause__, Remote)
    with pytest.raises(Unavailable, match="read x: try later"), mapped_errors("read x", table):
        raise Remote(500)
    # Not in the table, and trims errors: they pass unchanged.
    with pytest.raises(KeyError), mapped_errors("read x", table):
        raise KeyError("k")
    with pytest.raises(ValidationError, match=r"^mine$"), mapped_errors("read x", table):
        raise ValidationError("mine")

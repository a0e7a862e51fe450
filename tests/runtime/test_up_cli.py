"""`trims up --examples`: the folder the example evaluate and trace functions record into (under
/tmp, read by the web UI) belongs to the gateway's user; the function user may write in it and
another local user cannot have made it first."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.fixtures.unprivileged import writable_by_functions
from tests.fixtures.users import NOBODY, run_as
from trims.errors import ValidationError
from trims.runtime.up_cli import own_results_folder

OTHER_USER = 1000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners: needs root")


def test_the_gateway_owns_the_folder_and_the_function_user_writes_in_it(tmp_path: Path) -> None:
    folder = writable_by_functions(tmp_path / "shared") / "trims-results"
    own_results_folder(folder, str(NOBODY))
    st = folder.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, NOBODY, 0o770)

    def as_function_user() -> list[bool]:
        (folder / "results.sqlite-journal").write_text("")
        try:
            folder.chmod(0o777)
        except PermissionError:
            return [True, False]
        return [True, True]

    assert run_as(NOBODY, as_function_user) == [True, False]  # writes, cannot open it up
    own_results_folder(folder, None)  # a gateway that runs code as itself keeps it to itself
    assert stat.S_IMODE(folder.lstat().st_mode) == 0o700


def test_a_folder_or_link_another_user_made_first_is_refused(tmp_path: Path) -> None:
    shared = writable_by_functions(tmp_path / "shared")
    planted = shared / "trims-results"

    def plant() -> None:
        planted.mkdir()
        planted.chmod(0o777)

    run_as(OTHER_USER, plant)
    with pytest.raises(ValidationError, match=f"belongs to uid {OTHER_USER}"):
        own_results_folder(planted, str(NOBODY))
    assert planted.lstat().st_uid == OTHER_USER and stat.S_IMODE(planted.lstat().st_mode) == 0o777
    link = shared / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ValidationError, match="is not a folder"):
        own_results_folder(link, str(NOBODY))

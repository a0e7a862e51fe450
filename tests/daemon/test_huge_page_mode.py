"""The CPU tier's start-up line says which page size its memfds get, from the sysfs settings."""

from __future__ import annotations

from pathlib import Path

from trims.daemon.tiers.cpu import huge_page_mode


def _sysfs(root: Path, top: str, sizes: dict[str, str]) -> Path:
    root.mkdir()
    modes = ("always", "within_size", "advise", "never", "deny", "force")
    (root / "shmem_enabled").write_text(" ".join(f"[{m}]" if m == top else m for m in modes))
    for size, mode in sizes.items():
        entry = root / f"hugepages-{size}"
        entry.mkdir()
        choices = ("always", "inherit", "within_size", "advise", "never")
        (entry / "shmem_enabled").write_text(
            " ".join(f"[{m}]" if m == mode else m for m in choices)
        )
    return root


def test_never_means_4k_pages_and_says_how_to_change_it(tmp_path: Path) -> None:
    line = huge_page_mode(_sysfs(tmp_path / "thp", "never", {"2048kB": "inherit"}))
    assert "'never'" in line and "4 KiB pages" in line and "echo advise" in line


def test_advise_gives_the_largest_enabled_size(tmp_path: Path) -> None:
    root = _sysfs(
        tmp_path / "thp", "advise", {"64kB": "never", "2048kB": "inherit", "32kB": "always"}
    )
    line = huge_page_mode(root)
    assert "up to 2048kB" in line and "32kB, 2048kB" in line and "64kB" not in line


def test_unreadable_settings_fall_back_to_small_pages(tmp_path: Path) -> None:
    assert "4 KiB pages" in huge_page_mode(tmp_path / "missing")

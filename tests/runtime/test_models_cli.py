"""`trims models` run as a real subprocess against a real daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.store import DaemonProcess
from trims.config import format_size

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def trims_models(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    return subprocess.run(
        [sys.executable, "-m", "trims", "models", "--socket", str(socket), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def ok(socket: Path, *args: str) -> str:
    done = trims_models(socket, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "emb.safetensors"
    weights = {"emb": np.ones((256, 64), np.float32), "ids": np.arange(3, dtype=np.int64)}
    safetensors_numpy.save_file(weights, str(path))
    return path


def test_model_lifecycle(store_daemon: DaemonProcess, source: Path) -> None:
    sock = store_daemon.socket
    assert "no models in the store" in ok(sock, "ls")

    added = trims_models(sock, "add", "emb", str(source), "--version", "2")
    assert added.returncode == 0, added.stderr
    assert "added emb:2" in added.stdout
    # stderr is a pipe here, not a terminal: one line per finished stage instead of bars.
    assert re.search(r"^convert +[\d.]+ \S+ in [\d.]+ s \(", added.stderr, re.M), added.stderr
    assert "%|" not in added.stderr, "a progress bar drawn into a pipe"

    table = ok(sock, "ls").splitlines()
    assert table[0].split() == [
        "NAME", "VERSION", "FORMAT", "SIZE", "TIERS", "PINNED", "LEASES", "DIGEST"
    ]  # fmt: skip
    assert table[1].split()[:5] == [
        "emb",
        "2",
        "safetensors",
        "68.0",
        "KiB",
    ]  # 64 KiB + ids, page-rounded

    [model] = json.loads(ok(sock, "ls", "--json"))
    assert model["name"] == "emb" and model["tiers"] == ["disk"]
    info = json.loads(ok(sock, "--json", "info", "emb"))
    assert sorted(t["name"] for t in info["manifest"]["tensors"]) == ["emb", "ids"]
    assert "emb" in ok(sock, "info", "emb", "--version", "2")

    assert json.loads(ok(sock, "--json", "load", "emb"))["tiers"] == ["cpu", "disk"]
    assert "pinned in: cpu" in ok(sock, "pin", "emb")
    refused = trims_models(sock, "evict", "emb", "--tier", "cpu")
    assert refused.returncode == 1 and "unpin it first" in refused.stderr
    assert "pinned in: -" in ok(sock, "unpin", "emb")
    assert json.loads(ok(sock, "--json", "evict", "emb", "--tier", "cpu")) == {"evicted": ["cpu"]}
    assert "cpu" in ok(sock, "stats")

    assert "removed emb:2" in ok(sock, "rm", "emb")
    assert json.loads(ok(sock, "--json", "ls")) == []


def test_a_load_reports_each_stage_once(tmp_path: Path, store_daemon: DaemonProcess) -> None:
    """The daemon interleaves load and verify reports per 4 MiB chunk: still one line each,
    and a verify line exactly when the load hashed (a page-cache copy of a blob verified at
    its add is not hashed again: Note [trusted re-loads])."""
    path = tmp_path / "big.safetensors"
    safetensors_numpy.save_file({"w": np.ones((40, 1 << 18), np.float32)}, str(path))  # 40 MiB
    ok(store_daemon.socket, "add", "big", str(path), "--no-progress")
    loaded = trims_models(store_daemon.socket, "load", "big", "--tier", "cpu")
    assert loaded.returncode == 0, loaded.stderr
    stages = [line.split()[0] for line in loaded.stderr.splitlines()]
    hashed = json.loads(ok(store_daemon.socket, "--json", "stats"))["tiers"]["cpu"]["hashed_bytes"]
    assert sorted(stages) == (["load", "verify"] if hashed else ["load"]), loaded.stderr
    quiet = trims_models(store_daemon.socket, "evict", "big", "--tier", "cpu")
    assert quiet.returncode == 0, quiet.stderr
    quiet = trims_models(store_daemon.socket, "load", "big", "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_bad_input_gets_a_message_and_status_1(store_daemon: DaemonProcess, tmp_path: Path) -> None:
    done = trims_models(store_daemon.socket, "add", "emb", str(tmp_path / "missing.safetensors"))
    assert done.returncode == 1 and "missing.safetensors" in done.stderr
    done = trims_models(store_daemon.socket, "info", "nothing")
    assert done.returncode == 1 and "not in the store" in done.stderr


def test_no_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    done = trims_models(tmp_path / "none.sock", "ls")
    assert done.returncode == 1
    assert "none.sock" in done.stderr and "trims daemon" in done.stderr


def test_add_with_an_access_list_by_name_and_number(
    store_daemon: DaemonProcess, source: Path
) -> None:
    sock = store_daemon.socket
    added = trims_models(
        sock, "add", "emb", str(source), "--allow-uid", "root", "--allow-uid", "4242",
        "--allow-gid", "nogroup",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert "access:      uid 0, uid 4242, gid 65534" in added.stdout
    [model] = json.loads(ok(sock, "ls", "--json"))
    assert model["access"] == {"uids": [0, 4242], "gids": [65534]}
    assert "uid 0, uid 4242, gid 65534" in ok(sock, "info", "emb")
    unknown = trims_models(sock, "add", "x", str(source), "--allow-gid", "no-such-group")
    assert unknown.returncode == 1 and "no group of that name" in unknown.stderr
    too_big = trims_models(sock, "add", "x", str(source), "--allow-uid", str(2**70))
    assert too_big.returncode == 1 and "access.uids[0]" in too_big.stderr


def test_verify_hashes_every_disk_copy_again_and_deletes_a_damaged_one(
    store_daemon: DaemonProcess, tmp_path: Path
) -> None:
    sock = store_daemon.socket
    for name, value in (("good", 1.0), ("bad", 2.0)):
        path = tmp_path / f"{name}.safetensors"
        safetensors_numpy.save_file({"w": np.full((64, 64), value, np.float32)}, str(path))
        ok(sock, "add", name, str(path), "--no-progress")
    ok(sock, "load", "good", "--tier", "cpu", "--no-progress")

    def hashed() -> int:
        return int(json.loads(ok(sock, "--json", "stats"))["tiers"]["disk"]["hashed_bytes"])

    before = hashed()
    scrub = trims_models(sock, "verify")
    assert scrub.returncode == 0, scrub.stderr
    # one progress line for the whole scrub: both layouts' bytes together
    sizes = {m["name"]: m["total_bytes"] for m in json.loads(ok(sock, "--json", "ls"))}
    total = format_size(sum(sizes.values()))
    assert re.fullmatch(rf"verify +{total} in [\d.]+ s \(.*\)\n", scrub.stderr), scrub.stderr
    table = scrub.stdout.splitlines()
    assert table[0].split() == ["MODELS", "DIGEST", "SIZE", "RESULT"]
    assert sorted(line.split()[0] for line in table[1:]) == ["bad:1", "good:1"]
    assert all(line.split()[-1] == "ok" for line in table[1:]), table
    assert hashed() - before == sum(sizes.values())  # stamps unchanged, hashed anyway

    quiet = trims_models(sock, "--json", "verify", "good", "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == ""
    [only] = json.loads(quiet.stdout)["verified"]
    assert only["models"] == ["good:1"] and only["state"] == "ok"

    digest = json.loads(ok(sock, "--json", "info", "bad"))["digest"]
    blob = store_daemon.store_dir / "disk" / "blobs" / digest
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.seek(sizes["bad"] - 4096)
        f.write(b"\x00" * 4)
    done = trims_models(sock, "verify")
    assert done.returncode == 1, done.stderr
    assert re.search(r"^bad:1 +\w+ +[\d.]+ \S+ +damaged: ", done.stdout, re.M), done.stdout
    assert re.search(r"^good:1 .* ok$", done.stdout, re.M), done.stdout
    assert "1 damaged: deleted from the disk tier" in done.stdout
    assert not blob.exists()
    assert "not on disk" in ok(sock, "verify", "bad", "--version", "1")
    assert json.loads(ok(sock, "--json", "info", "good"))["tiers"] == ["cpu", "disk"]
    refused = trims_models(sock, "verify", "--version", "1")
    assert refused.returncode == 1 and "--version needs a model NAME" in refused.stderr
    missing = trims_models(sock, "verify", "nothing")
    assert missing.returncode == 1 and "not in the store" in missing.stderr
    good = json.loads(ok(sock, "--json", "info", "good"))["digest"]
    for path in (blob.with_name(good), blob.with_name(f"{good}.json")):
        path.unlink()  # gone behind the daemon's back: reported, not an error
    assert "not on disk" in ok(sock, "verify", "good")

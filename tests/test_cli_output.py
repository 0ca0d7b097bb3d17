"""``--output FILE`` writes regular files only: a link, a pipe, a device or a folder is refused.

The refusal comes before anything is read or written: a symlink's target is
left untouched (the link is never followed), a named pipe is never opened (so
nothing blocks), and a regular file is still replaced atomically.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.cli import main

EXPORTS = [["sessions", "export"], ["users", "export", "alice"]]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_KEYS", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('out') / 'o.db'}"
    with open_store(url) as store:
        agent = Agent(name="a", instructions="", model="gemini-2.5-flash")
        ctx = store.get_or_create("s1", agent, user_id="alice")
        ctx.add_message(Message(role=Role.USER, content="hi"))
    return url


def refused(capsys: pytest.CaptureFixture[str], url: str, argv: list[str], target: Path) -> str:
    code = main(["--url", url, *argv, "--output", str(target)])
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "nothing was written" in lines[0]
    assert not list(target.parent.glob(".*.partial"))
    return lines[0]


@pytest.mark.parametrize("argv", EXPORTS)
def test_a_symlink_is_refused_and_its_target_untouched(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / "export.jsonl"
    link.symlink_to(target)
    assert "symbolic link" in refused(capsys, url, argv, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "keep me\n"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "symbolic link" in refused(capsys, url, argv, dangling)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("argv", EXPORTS)
def test_a_named_pipe_is_refused_without_opening_it(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert "named pipe" in refused(capsys, url, argv, fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("argv", EXPORTS)
def test_a_folder_and_a_device_are_refused(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    assert "folder" in refused(capsys, url, argv, folder)
    assert list(folder.iterdir()) == []
    code = main(["--url", url, *argv, "--output", os.devnull])
    err = capsys.readouterr().err
    assert code == 2 and "a device" in err
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.parametrize("argv", EXPORTS)
def test_a_regular_file_is_replaced_privately(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    target = tmp_path / "export.jsonl"
    target.write_text("old\n")
    target.chmod(0o644)
    code = main(["--url", url, *argv, "--output", str(target), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["output"] == str(target)
    assert "s1" in target.read_text() and "old" not in target.read_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".*.partial"))

"""The command line as a user first meets it: version, help, summaries, ``--json`` everywhere.

Real SQLite files only; timings are in benchmarks, never asserted here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import click
import pytest

from chatflow_sqlalchemy.cli import cli, main

GROUPS = ["db", "sessions", "dedup", "inbox", "users", "keys"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_AUTO_MIGRATE", raising=False)
    monkeypatch.delenv("CHATFLOW_KEYS", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "80")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def commands(group: click.Group = cli, path: tuple[str, ...] = ()) -> Iterator[
    tuple[tuple[str, ...], click.Command]
]:
    """Every command and group under ``group``, with its path of names."""
    for name, command in sorted(group.commands.items()):
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.strip() == f"chatflow-sqlalchemy {version('chatflow-sqlalchemy')}"


@pytest.mark.parametrize("argv", [[], ["--url", "sqlite:///x.db"], *([g] for g in GROUPS)])
def test_no_command_prints_the_help(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "Missing command" not in out + err
    group = " ".join(arg for arg in argv if arg in GROUPS)
    assert out.startswith(f"Usage: chatflow-sqlalchemy {group}".rstrip() + " ")
    assert "Commands:" in out


def test_summaries_are_whole_and_the_exit_codes_shown_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, top, _ = run(capsys, "--help")
    assert code == 0 and top.count("Exit codes") == 1
    for path, command in commands():
        code, out, _ = run(capsys, *path, "--help")
        assert code == 0, path
        assert "Exit codes" not in out, path
        assert "``" not in out, path  # no raw reStructuredText
        if isinstance(command, click.Group):
            listing = out.split("Commands:", 1)[1]
            for line in listing.strip().splitlines():
                assert not line.rstrip().endswith("..."), (path, line)
    for line in top.split("Commands:", 1)[1].split("Exit codes", 1)[0].strip().splitlines():
        assert not line.rstrip().endswith("..."), line


def test_every_command_takes_json() -> None:
    missing = [
        " ".join(path)
        for path, command in commands()
        if not isinstance(command, click.Group)
        and not any("--json" in getattr(p, "opts", []) for p in command.params)
    ]
    assert missing == []


def test_db_history_prints_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "db", "history", "--all")
    assert code == 0
    assert "`" not in out
    assert "chatflow_turn_lock" in out  # the literal's text is kept
    code, out, _ = run(capsys, "db", "history", "--json")
    docs = [rev["doc"] for rev in json.loads(out)["chains"][0]["revisions"]]
    assert not any("`" in doc for doc in docs)


def test_write_commands_print_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chatflow_agent import Agent, Message, Role

    from chatflow_sqlalchemy import open_store

    url = f"sqlite:///{tmp_path / 'w.db'}"
    code, out, err = run(capsys, "--url", url, "db", "upgrade", "--json")
    assert code == 0, err
    upgraded = json.loads(out)
    assert upgraded["chains"][0]["from"] is None and upgraded["chains"][0]["at_head"]
    with open_store(url) as store:
        agent = Agent(name="a", instructions="", model="gemini-2.5-flash")
        store.get_or_create("s1", agent).add_message(Message(role=Role.USER, content="hi"))
        with store.claim("m1", session_id="s1") as claim:
            claim.response = "ok"

    code, out, _ = run(capsys, "--url", url, "sessions", "delete", "s1", "--yes", "--json")
    assert code == 0 and json.loads(out) == {"session_id": "s1", "deleted": True,
                                                "session_existed": True}
    code, out, _ = run(capsys, "--url", url, "sessions", "list", "--json")
    assert json.loads(out)["sessions"] == []
    code, out, _ = run(capsys, "--url", url, "dedup", "purge", "--yes", "--json")
    assert code == 0 and json.loads(out)["removed"] == 0
    head = upgraded["chains"][0]["to"]
    code, out, _ = run(capsys, "--url", url, "db", "stamp", head, "--json")
    assert code == 0 and json.loads(out)["to"] == head
    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "base", "--yes", "--json")
    assert code == 0 and [c["to"] for c in json.loads(out)["chains"]] == [None]


def test_show_is_plain_text_when_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from chatflow_agent import Agent, Message, Role

    from chatflow_sqlalchemy import open_store

    url = f"sqlite:///{tmp_path / 'p.db'}"
    with open_store(url) as store:
        agent = Agent(name="a", instructions="", model="gemini-2.5-flash")
        store.get_or_create("s", agent).add_message(
            Message(role=Role.USER, content="[bold]hi[/bold] \x1b[31mred")
        )
    for argv in (["sessions", "show", "s"], ["sessions", "list"], ["backends"]):
        code, out, err = run(capsys, "--url", url, *argv)
        assert code == 0, err
        assert "\x1b" not in out, argv
    code, out, _ = run(capsys, "--url", url, "sessions", "show", "s")
    assert "[bold]hi[/bold] \\x1b[31mred" in out


def test_version_and_bare_help_import_nothing_heavy() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from chatflow_sqlalchemy.cli import main\n"
        "for argv in (['--version'], [], ['sessions'], ['keys', '--help']):\n"
        "    assert main(argv) == 0, argv\n"
        "heavy = ('sqlalchemy', 'alembic', 'chatflow_agent', 'rich', 'pydantic')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"

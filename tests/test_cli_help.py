"""Every subcommand honours --help: it prints its usage and exits 0 without doing anything else (issue 31: `platform
--help` used to run the command)."""

from __future__ import annotations

import pytest

from megatron_sao import cli


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_subcommand_prints_its_usage_and_does_nothing_else(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m megatron_sao {command}"), out[:200]
    assert "CUDA absent" not in out and "[run]" not in out  # the command itself did not run

"""`python -m megatron_sao <command>`: the command line (megatron_sao/cli.py)."""

from megatron_sao.cli import main

raise SystemExit(main())

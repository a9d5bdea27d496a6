from megatron_sao.cli import main

raise SystemExit(main())

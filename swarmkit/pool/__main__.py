from swarmkit.pool.journal import _main

raise SystemExit(_main())

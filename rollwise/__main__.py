from rollwise.cli import main

raise SystemExit(main())

from unisched.cli.main import main

raise SystemExit(main())

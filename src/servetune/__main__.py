from servetune.cli import main

raise SystemExit(main())

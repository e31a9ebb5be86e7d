from pdserve.kernels.build import main

raise SystemExit(main())

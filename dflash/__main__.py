from dflash import quiet

quiet.install()   # before any library is imported: their known-harmless lines never show

from dflash.cli import main  # noqa: E402

raise SystemExit(main())

import sys

from dflash import quiet

quiet.install()   # before any library is imported: their known-harmless lines never show

try:
    from dflash.cli import main  # noqa: E402
    code = main()
except KeyboardInterrupt:        # Ctrl-C before a stage starts (imports, arguments): the stage names itself after
    print("dflash: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
    code = 130
raise SystemExit(code)

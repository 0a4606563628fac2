"""Run any stage by any of its names: python -m stages 03 --model DIR --prompt "Hello" [options].

The first argument names the stage ("03", "3", "03_paged", "paged", "final", ...); everything
after it goes to that stage's own command line (python -m stages 03 --help lists its flags).
"""

import importlib
import sys

import stages


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            f"{__doc__.strip()}\n\nstages: {', '.join(stages.names())}, {stages.FINAL}",
            file=sys.stdout if argv else sys.stderr,
        )
        raise SystemExit(0 if argv else 2)
    try:
        stage = stages.load(argv[0])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    importlib.import_module(f"{stage.__name__}.__main__").main(argv[1:])


if __name__ == "__main__":
    main()

"""``python -m jfp8kv COMMAND [flags]``: the jfp8kv commands.

    generate   generate text for prompts given on the command line
    serve      run the OpenAI-compatible server (also ``python -m jfp8kv.serve``)
    calibrate  measure static fp8 KV scales over text (also ``python -m jfp8kv.calibrate``)

``python -m jfp8kv COMMAND --help`` lists a command's flags.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": "jfp8kv.entrypoints.generate",
    "serve": "jfp8kv.serve.__main__",
    "calibrate": "jfp8kv.entrypoints.calibrate",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        asked_for_help = bool(argv) and argv[0] in ("-h", "--help")
        out = sys.stdout if asked_for_help else sys.stderr
        if argv and not asked_for_help:
            print(f"python -m jfp8kv: error: unknown command {argv[0]!r}; choose one of "
                  f"{list(COMMANDS)}", file=out)
        print(__doc__, file=out)
        return 0 if asked_for_help else 2
    command = importlib.import_module(COMMANDS[argv[0]])
    return command.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())

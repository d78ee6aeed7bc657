"""The shared entry-point wrapper of train.py and tools/*.py."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

from ..errors import InternLMCoreError
from .redact import redact_text


def run_main(main: Callable[[], int]) -> NoReturn:
    """Exit with main()'s status; a user error (InternLMCoreError) prints one `error:` line and exits 2,
    since its message says what to fix and a traceback would not. Other exceptions are bugs and keep theirs."""
    try:
        sys.exit(main())
    except InternLMCoreError as e:
        print(f"error: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(2)

"""Where the shared reference data lives: ../shared/fixtures beside the repository (or $INTERNLM_CORE_FIXTURES)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _internlm_fixtures() -> Path:
    for candidate in (os.environ.get("INTERNLM_CORE_FIXTURES"), ROOT.parent / "shared" / "fixtures" / "internlm",
                      "/work/shared/fixtures/internlm"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise FileNotFoundError("the InternLM reference fixtures were not found: expected ../shared/fixtures/internlm "
                            "beside the repository, or set INTERNLM_CORE_FIXTURES")


INTERNLM_FIXTURES = _internlm_fixtures()

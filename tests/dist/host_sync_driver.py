"""torchrun driver: train.py's main, counting each step's host syncs (tests/helpers/host_syncs.py) in the
trainer's step and decisions; each rank writes {step: [sites]} to `{prefix}.rank{R}.json`."""

import json
import os
import sys

import train
from internlm_core.trainer.trainer import Trainer
from tests.helpers.host_syncs import HostSyncs

STEPS: dict = {}


def _counted(method, part):
    def wrapped(self, *args):
        with HostSyncs(self.device) as syncs:
            syncs.host(args[0])  # the loader's batch (train_step) or the metrics (_decide): on the host
            if self.context is not None:  # the cut's cached token indices, made on the host at the first step
                syncs.host(list(self.context._indices.values()))
            out = method(self, *args)
        STEPS.setdefault(self.state.batch_count, []).extend(f"{part}: {s}" for s in syncs.sites)
        return out
    return wrapped


if __name__ == "__main__":
    Trainer.train_step = _counted(Trainer.train_step, "step")
    Trainer._decide = _counted(Trainer._decide, "decide")
    rc = train.main(sys.argv[2:])
    with open(f"{sys.argv[1]}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(STEPS, f)
    sys.exit(rc)

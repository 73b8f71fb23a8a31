import os

import pytest
import torch

# One intra-op thread: the tests run tiny models, where thread hand-offs cost far more than they save
# (20x on a busy 2-core machine).
torch.set_num_threads(1)


@pytest.fixture
def usage_error(capsys):
    """usage_error(parse, argv): what a command line's `parse` (argparse, or a main) writes to stderr as it
    refuses argv with exit code 2, an ordinary mistake."""
    def refused(parse, argv):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err
    return refused


def checkout_env(root, **extra):
    """os.environ for a subprocess that runs this checkout's packages (root first on PYTHONPATH), not an installed
    copy, keeping the paths already set there (a folder of wheels on a GPU host)."""
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}

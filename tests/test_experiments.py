import runpy

import kit
import pytest
from conftest import ROOT


@pytest.mark.skipif(kit.ON_GPU, reason="on a GPU the script also benchmarks; run it by hand")
def test_split_row_softmax_experiment_checks_out_under_the_interpreter(capsys):
    runpy.run_path(str(ROOT / "tools" / "experiments" / "softmax_split_rows.py"))
    assert "matches torch" in capsys.readouterr().out

import runpy

import kit
import pytest
from conftest import ROOT


@pytest.mark.skipif(kit.ON_GPU, reason="on a GPU the script also benchmarks; run it by hand")
def test_flat_fused_dropout_experiment_matches_the_chapter_under_the_interpreter(capsys):
    runpy.run_path(str(ROOT / "tools" / "experiments" / "fused_dropout_sweep.py"))
    assert "bit for bit" in capsys.readouterr().out


@pytest.mark.skipif(kit.ON_GPU, reason="on a GPU the script also benchmarks; run it by hand")
def test_split_row_softmax_backward_experiment_checks_out_under_the_interpreter(capsys):
    runpy.run_path(str(ROOT / "tools" / "experiments" / "softmax_split_backward.py"))
    assert "matches torch.autograd" in capsys.readouterr().out


@pytest.mark.skipif(kit.ON_GPU, reason="on a GPU the script also benchmarks; run it by hand")
def test_matmul_operand_order_experiment_checks_out_under_the_interpreter(capsys):
    runpy.run_path(str(ROOT / "tools" / "experiments" / "matmul_operand_order.py"))
    assert "same product" in capsys.readouterr().out

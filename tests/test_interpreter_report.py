"""The Triton-interpreter child's report (tests/helpers/interpreter.py): a failure's traceback is what the parent
shows, however much captured output of passing tests -rA prints after it."""
from helpers.interpreter import failures


def child_output(failed: bool, passes: int) -> str:
    lines = ["============================= test session starts ==============================", "..F." * 20]
    if failed:
        lines += ["=================================== FAILURES ===================================",
                  "____________________________ test_kernel[bf16-T3] _____________________________",
                  "E       AssertionError: pos_TK"]
    lines += ["==================================== PASSES ===================================="]
    lines += [f"tests/ops/test_x.py::test_{i}: MOE_TEST_SEED={i}" for i in range(passes)]
    lines += ["=========================== short test summary info ============================",
              "PASSED tests/ops/test_x.py::test_0"]
    return "\n".join(lines)


def test_the_failures_come_without_the_passes_output():
    shown = failures(child_output(True, 2000))
    assert shown.startswith("=" * 35 + " FAILURES") and "E       AssertionError: pos_TK" in shown
    assert "MOE_TEST_SEED" not in shown and "PASSED" not in shown and len(shown) < 300


def test_without_a_failure_the_head_of_the_run_is_kept():
    shown = failures(child_output(False, 3))
    assert shown.startswith("=" * 29 + " test session starts") and "MOE_TEST_SEED" not in shown

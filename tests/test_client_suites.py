"""CPU checks of the client-suite runner (scripts/stage_flashinfer_tests.py, scripts/stage_vllm_tests.py): the
case selection, the verdicts, the counts that never call an unrun case passed, and a small suite run end to end
under its deadline."""

import importlib.util
import json
import random
import sys
import textwrap
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


sft = _load("stage_flashinfer_tests")
plugin = types.ModuleType("client_run_plugin")
exec(compile(sft.PLUGIN, "client_run_plugin.py", "exec"), plugin.__dict__)

IDS = [f"tests/t.py::test_{f}[{i}]" for f in "abc" for i in range(40)] + ["tests/t.py::test_d"]


def test_seeded_sample_is_uniform_reproducible_and_shuffled():
    order = plugin.select(IDS, cases=30, seed=7)
    assert len(order) == len(set(order)) == 30
    assert order == plugin.select(IDS, cases=30, seed=7)
    assert order != sorted(order)  # run in a random order: a time limit cuts every function alike
    # the sample is random.Random(seed)'s and the order random.Random(seed + 1)'s, so a seed names the same cases
    picked = sorted(random.Random(7).sample(range(len(IDS)), 30))
    random.Random(8).shuffle(picked)
    assert order == picked
    assert plugin.select(IDS, cases=30, seed=8) != order


def test_seed_alone_runs_every_case_in_a_random_order():
    order = plugin.select(IDS, seed=3)
    assert sorted(order) == list(range(len(IDS))) and order != sorted(order)
    assert plugin.select(IDS) == list(range(len(IDS)))
    assert plugin.select(IDS, cases=len(IDS) + 5) == list(range(len(IDS)))


def test_step_and_even_share_per_function():
    assert plugin.select(IDS, step=10) == list(range(0, len(IDS), 10))
    order = plugin.select(IDS, cases=12)
    fns = [IDS[i].split("[")[0] for i in order]
    # round-robin over the functions, about an even share each, spread over each function's parameters
    assert fns[:4] == ["tests/t.py::test_a", "tests/t.py::test_b", "tests/t.py::test_c", "tests/t.py::test_d"]
    assert {f: fns.count(f) for f in set(fns)} == {
        "tests/t.py::test_a": 3, "tests/t.py::test_b": 3, "tests/t.py::test_c": 3, "tests/t.py::test_d": 1
    }  # fmt: skip
    assert [i for i in order if IDS[i].startswith("tests/t.py::test_a")] == [0, 14, 28]


@pytest.mark.parametrize(
    "phases, expected",
    [
        ({"setup": ("passed", False), "call": ("passed", False), "teardown": ("passed", False)}, "passed"),
        ({"setup": ("passed", False), "call": ("failed", False), "teardown": ("passed", False)}, "failed"),
        ({"setup": ("failed", False), "teardown": ("passed", False)}, "error"),
        ({"setup": ("skipped", False), "teardown": ("passed", False)}, "skipped"),
        ({"setup": ("skipped", True), "teardown": ("passed", False)}, "xfail"),
        ({"setup": ("passed", False), "call": ("skipped", False), "teardown": ("passed", False)}, "skipped"),
        ({"setup": ("passed", False), "call": ("skipped", True), "teardown": ("passed", False)}, "xfail"),
        ({"setup": ("passed", False), "call": ("passed", True), "teardown": ("passed", False)}, "xpass"),
        ({"setup": ("passed", False), "call": ("passed", False), "teardown": ("failed", False)}, "error"),
        ({"setup": ("passed", False), "teardown": ("passed", False)}, "error"),
    ],
)
def test_verdict(phases, expected):
    assert plugin.verdict(phases) == expected


def _case(nodeid, verdict, seconds=1.0, compile_s=0.5):
    return {"event": "case", "nodeid": nodeid, "verdict": verdict, "seconds": seconds, "start": 0.0,
            "worker": "gw0", "compile_s": compile_s, "compiled": 2, "cache_loads": 1, "message": "boom"}  # fmt: skip


def test_summary_counts_unreported_cases_as_not_run(tmp_path):
    rec = tmp_path / "s.records"
    rec.mkdir()
    ids = [f"t.py::test_x[{i}]" for i in range(6)]
    lines = [{"event": "selected", "in_scope": 50, "nodeids": ids}, {"event": "collected", "t": 103.0}]
    lines += [_case(ids[0], "passed"), _case(ids[1], "failed"), _case(ids[2], "xfail"), _case(ids[0], "passed")]
    (rec / "records-gw0-1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"event": "ca')
    (rec / "records-main-2.jsonl").write_text(json.dumps(_case(ids[3], "skipped", 3.0, 0.0)) + "\n")
    s = sft.summarize("s", rec, {"launched": 100.0, "workers": 2, "seed": 0, "seconds": 9.0})
    assert (s["in_scope"], s["selected"], s["ran"], s["not_run"]) == (50, 6, 4, 2)
    assert (s["passed"], s["failed"], s["xfail"], s["skipped"], s["error"]) == (1, 1, 1, 1, 0)
    assert (s["case_seconds"], s["compile_seconds"], s["kernels_compiled"], s["startup_median_s"]) == (6.0, 1.5, 8, 3)
    assert s["failures"] == ["t.py::test_x[1]: boom"]
    s["cut"] = True
    assert sft.summary_line(s) == (
        "s: in scope 50, selected 6, seed 0, ran 4: 1 passed, 1 failed, 0 error, 1 skipped, 1 xfail; "
        "not run 2 (time limit); 9.0 s, 2 workers"
    )
    assert "compiled 8 kernels in 1.5 s (25% of case time)" in sft.timing_line(s)


def test_summary_without_a_selection_says_nothing_ran(tmp_path):
    s = sft.summarize("s", tmp_path / "missing", {"workers": 0})
    assert s["selected"] is None and s["not_run"] is None and s["ran"] == 0


SUITE = """
import time
import pytest

@pytest.mark.parametrize("i", range(4))
def test_fast(i):
    assert i < 3

def test_skip():
    pytest.skip("not here")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.mark.parametrize("i", range(12))
def test_slow(i):
    time.sleep(1.5)
"""


def test_run_end_to_end_cuts_at_the_deadline(tmp_path):
    """A real pytest run: the verdicts, and the cases its deadline kept from starting counted as not run."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_toy.py").write_text(textwrap.dedent(SUITE))
    log = tmp_path / "log"
    suite = {"name": "toy", "cwd": str(tmp_path), "args": ["tests", "-p", "no:cacheprovider", "-k", "not fast[0]"]}
    # No case starts after 12 s: room for pytest's start on a loaded machine (the fast cases run first), while
    # the 18 s of slow cases still meet the cut.
    rc = sft.run_suites([suite], log, timeout=40, margin=28, grace=5)
    s = json.loads((log / "toy.summary.json").read_text())
    assert rc == 1  # a failed case
    assert s["in_scope"] == s["selected"] == 17  # -k's deselection happens before the runner's selection
    assert (s["passed"], s["failed"], s["skipped"], s["xfail"], s["error"]) == (2 + s["ran"] - 5, 1, 1, 1, 0)
    assert s["not_run"] > 0 and s["ran"] + s["not_run"] == 17 and s["cut"]
    assert "tests/test_toy.py::test_fast[3]: assert 3 < 3" in s["failures"]
    assert (log / "toy.xml").is_file() and "not run" in (log / "toy.summary.txt").read_text()


def test_parts_share_one_selection_and_add_up(tmp_path, capsys):
    """``--part K/N``: N processes (say on N GPUs) split one seeded selection; ``summary`` adds them up."""
    ids = [f"t.py::test_x[{i}]" for i in range(10)]
    for k in range(2):
        rec = tmp_path / f"p{k}.records"
        rec.mkdir()
        order = plugin.select(ids, seed=5)[k::2]
        mine = [ids[i] for i in order]
        lines = [{"event": "selected", "in_scope": 10, "nodeids": mine}]
        lines += [_case(n, "failed" if n.endswith("[3]") else "passed") for n in mine[:4]]
        (rec / "records-gw0-1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        s = sft.summarize(f"v-part{k}of2", rec, {"seed": 5, "seconds": 3.0 + k, "workers": 4})
        s["cut"] = True
        (tmp_path / f"v-part{k}of2.summary.json").write_text(json.dumps(s))
    assert sft.print_summaries(tmp_path) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "v: in scope 10, selected 10, seed 5, ran 8: 7 passed, 1 failed, 0 error, 0 skipped, 0 xfail; "
        "not run 2 (time limit); 4.0 s, 8 workers"
    )
    assert "t.py::test_x[3]: boom" in out[-1]

"""An ``LLM`` never shut down is stopped at interpreter exit by its finalizer; that must be silent.

The finalizer runs after concurrent.futures has marked itself shut down, so any part of the
engine's shutdown that still submitted to an executor raised "cannot schedule new futures after
shutdown" and Python printed the traceback. A real child process shows what a user would see.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", max_num_seqs=2, max_model_len=512)
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    print("generated", len(out.outputs[0].token_ids), flush=True)
    # no llm.shutdown(): the interpreter cleans it up
""")


def test_llm_left_to_the_interpreter_exits_silently():
    model_dir = str(harness.tiny_model_dir())
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model_dir], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "generated 3"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]

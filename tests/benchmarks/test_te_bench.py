"""benchmarks.te's table (CPU; the bench itself needs CUDA): medians with ranges, and compilations summed
over the timed rounds, a variant that failed shown with its error."""
from benchmarks import te


def test_summary_shows_medians_ranges_and_summed_compiles():
    row = {"decode_ms": 7.4, "prefill_tokens_per_s": 150_000.0}
    scaled = lambda f: {k: v * f for k, v in row.items()}  # noqa: E731
    result = {"variants": {
        "bf16": {"median": row, "min": scaled(0.9), "max": scaled(1.1), "compiles": 2},
        "te_block": {"error": "RuntimeError: recipe 'block' unavailable here"}}}
    lines = te.summary(result).splitlines()
    assert lines[1].split()[0] == "bf16" and "7.400 (6.660-8.140)" in lines[1] and lines[1].split()[-1] == "2"
    assert "error: RuntimeError: recipe 'block'" in lines[2]

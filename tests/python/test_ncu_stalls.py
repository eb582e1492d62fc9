"""bench/ncu_stalls.py on synthetic Nsight Compute exports (the GPU run is scripts/gpu-fp8-bench
with MOK_FP8_NCU=1): the reasons summed in order, the instructions ranked by samples, the
headlines picked from the details page, and a column-less export reported as such."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import ncu_stalls  # noqa: E402

CSV = '''==PROF== a line before the header
"# Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb","Instructions Executed"
"0x10","WARPGROUP.DEPBAR.LE gsb0, 0x0","600","0","0","10"
"0x20","LDG.E R4, desc[UR6][R2.64]","300","0","290","10"
"0x30","BAR.SYNC.DEFER_BLOCKING 0x1","100","95","0","10"
'''

DETAILS = '''    SM Frequency                    Ghz         1.82
    Duration                         ms         2.59
    Elapsed Cycles                cycle    4,790,308
    INF   Tensor is the highest-utilized pipeline (37.7%) based on elapsed cycles
'''


def test_reasons_and_instructions_in_order(tmp_path):
    csv_path = tmp_path / "k.sass.csv"
    csv_path.write_text(CSV)
    header, rows = ncu_stalls.read_rows(csv_path)
    assert header[0] == "# Address" and len(rows) == 3
    lines = ncu_stalls.stall_report(header, rows, top=2)
    assert lines[0] == "warp-state samples: 1000 over 3 instructions"
    reasons = lines[lines.index("by reason (share of all samples):") + 1:][:2]
    assert "29.0%" in reasons[0] and "stall_long_sb" in reasons[0]
    assert "9.5%" in reasons[1] and "stall_barrier" in reasons[1]
    top = lines[lines.index("top 2 instructions by samples:") + 1:]
    assert len(top) == 2
    assert "60.0%" in top[0] and "WARPGROUP.DEPBAR" in top[0]
    assert "30.0%" in top[1] and "LDG.E" in top[1] and "stall_long_sb 290" in top[1]


def test_headlines_and_a_column_less_export(tmp_path, capsys):
    details = tmp_path / "k.txt"
    details.write_text(DETAILS)
    got = ncu_stalls.headlines(details)
    assert got == ["SM Frequency Ghz 1.82", "Duration ms 2.59",
                   "INF Tensor is the highest-utilized pipeline (37.7%) based on elapsed cycles"]
    bare = tmp_path / "bare.csv"
    bare.write_text('"# Address","Source"\n"0x10","NOP"\n')
    assert ncu_stalls.main([str(bare)]) == 0
    assert "no warp-stall sample column; columns: # Address, Source" in capsys.readouterr().out
    empty = tmp_path / "empty.csv"
    empty.write_text("==ERROR== no report\n")
    assert ncu_stalls.main([str(empty)]) == 1

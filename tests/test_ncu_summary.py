"""benchmarks.experiments.ncu_decode's summary of Nsight Compute's raw CSV (the GPU run is gpu_session.sh ncu)."""

from __future__ import annotations

from benchmarks.experiments.ncu_decode import main, read_raw, summarize

HEADER = ['ID', 'Kernel Name', 'gpu__time_duration.sum', 'launch__registers_per_thread',
          'sm__warps_active.avg.pct_of_peak_sustained_active', 'dram__throughput.avg.pct_of_peak_sustained_elapsed',
          'sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active',
          'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active',
          'sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active',
          'smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio']
UNITS = ['', '', 'usecond', 'register/thread', '%', '%', '%', '%', '%', 'ratio', 'ratio', 'ratio']
ROW = ['0', 'decode_kernel<4, 3>', '96.35', '128', '21.4', '47.9', '33.5', '12.25', '40.1', '3.5', '1.25', '0.25']


def _csv(rows) -> str:
    return "\n".join(",".join(f'"{x}"' for x in r) for r in rows) + "\n"


def test_summary_reads_the_raw_page_among_other_output(tmp_path, capsys):
    path = tmp_path / "int4-cuda.csv"
    path.write_text("==PROF== Connected to process 1\nint4 cuda: config {...}\n" + _csv([HEADER, UNITS, ROW])
                    + "==PROF== Disconnected\n")
    (row,) = read_raw(str(path))
    assert row["Kernel Name"] == "decode_kernel<4, 3>"
    text = summarize(str(path))
    assert "time_us=96.35" in text and "regs=128" in text and "occ_achieved_%=21.4" in text and "dram_%=47.9" in text
    # pipes busiest first; stalls largest first with their share of the total
    assert text.index("lsu 40.1") < text.index("alu 33.5") < text.index("tensor_op_hmma 12.2")
    assert "long_scoreboard 3.50 (70%)" in text and text.index("long_scoreboard") < text.index("mio_throttle")
    assert main(["summary", str(path)]) == 0 and "decode_kernel<4, 3>" in capsys.readouterr().out


def test_kernel_times_are_given_in_microseconds_whatever_unit_ncu_picked(tmp_path):
    """ncu's raw page gives durations in its own unit (on the H200, 94,976 ns for a 95 µs launch)."""
    path = tmp_path / "int4-cuda.csv"
    for unit, value, shown in (("ns", "94,976", "94.98"), ("msecond", "0.5", "500.00"), ("usecond", "96.35", "96.35")):
        path.write_text(_csv([HEADER, [u if u != "usecond" else unit for u in UNITS],
                              [v if v != "96.35" else value for v in ROW]]))
        assert f"time_us={shown}" in summarize(str(path))


def test_a_run_that_profiled_nothing_says_so(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== No kernels were profiled.\n")
    assert read_raw(str(path)) == [] and "no kernel rows" in summarize(str(path))


def test_h100_names_and_the_derived_columns(tmp_path):
    """The H100's ncu names DRAM throughput gpu__dram_throughput; DRAM bytes a second read as TB/s, and the
    busiest SM's empty share of the elapsed cycles is 1 - its active cycles / the elapsed ones."""
    header = HEADER[:5] + ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes.sum.per_second",
                           "gpc__cycles_elapsed.max", "sm__cycles_active.max"]
    units = UNITS[:5] + ["%", "byte/s", "cycle", "cycle"]
    row = ROW[:5] + ["73.19", "2,453,133,528,673.08", "137,565", "127,930"]
    path = tmp_path / "int4-cuda.csv"
    path.write_text(_csv([header, units, row]))
    text = summarize(str(path))
    assert "dram_%=73.19" in text and "dram_TBps=2.45" in text and "busiest_sm_idle_%=7.0" in text

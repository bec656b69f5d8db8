"""Inspection tools: read a run directory, merge its traces, draw its timeline, tabulate its
communication and memory (``python -m minidist.inspect RUN_DIR``)."""
from minidist.inspect.chrome import merge_chrome_trace
from minidist.inspect.load import Run, load_run, memory_path, trace_path
from minidist.inspect.tables import comm_table, format_comm_table, format_memory
from minidist.inspect.timeline import busy_seconds, compute_seconds, draw_run_timeline, step_title, step_window
from minidist.inspect.write import model_state_bytes, step_peak_bytes, stream_trace, write_memory_report, write_trace

__all__ = ["merge_chrome_trace", "Run", "load_run", "memory_path", "trace_path", "comm_table",
           "format_comm_table", "format_memory", "busy_seconds", "compute_seconds", "draw_run_timeline",
           "step_title", "step_window", "model_state_bytes", "step_peak_bytes", "stream_trace",
           "write_memory_report", "write_trace"]

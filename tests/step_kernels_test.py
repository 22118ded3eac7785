"""scripts/gpu_host/step_kernels.py's reading of Nsight Compute's CSV, on a hand-written profile
in ncu's --csv layout (its banner lines, a second metric, thousands separators, the units it
prints): the kernel count, the times in microseconds and the groups by name and grid, each
worked out by hand below. Needs no GPU."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_host"))
import step_kernels  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def row(i, kernel, grid, metric, unit, value):
    return (f'"{i}","1","bench","127.0.0.1","{kernel}","1","13","(256, 1, 1)","{grid}","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


PROFILE = "\n".join([
    "==PROF== Connected to process 1",
    "decode step: batch 1, context 147, 32 layers, splits 1",
    HEADER,
    row(0, "embedding_kernel(const int *)", "(1, 1, 1)", "gpu__time_duration.sum", "ns", "5,920"),
    row(1, "add_rms_norm_vec_kernel<2>(float *)", "(1, 1, 1)", "gpu__time_duration.sum", "ns",
        "4,448"),
    row(2, "add_rms_norm_vec_kernel<2>(float *)", "(1, 1, 1)", "gpu__time_duration.sum",
        "usecond", "4.552"),
    row(3, "add_rms_norm_vec_kernel<2>(float *)", "(1, 1, 1)", "dram__bytes.sum", "byte", "8,192"),
    row(4, "add_rms_norm_vec_kernel<2>(float *)", "(256, 1, 1)", "gpu__time_duration.sum", "ms",
        "0.0125"),
    "==PROF== Disconnected from process 1",
])


class StepKernelsTest(unittest.TestCase):
    def test_times_in_microseconds(self):
        times = step_kernels.kernel_times(PROFILE)
        # Four timed kernels (the dram__bytes row is another metric); 5,920 ns = 5.92 us,
        # 4,448 ns = 4.448 us, 4.552 usecond, 0.0125 ms = 12.5 us.
        self.assertEqual([grid for _, grid, _ in times],
                         ["(1, 1, 1)", "(1, 1, 1)", "(1, 1, 1)", "(256, 1, 1)"])
        for (_, _, us), want in zip(times, [5.92, 4.448, 4.552, 12.5]):
            self.assertAlmostEqual(us, want, places=9)

    def test_table_groups_by_name_and_grid(self):
        text = step_kernels.table(step_kernels.kernel_times(PROFILE), top=16)
        lines = text.splitlines()
        # 5.92 + 4.448 + 4.552 + 12.5 = 27.42 us in four kernels.
        self.assertEqual(lines[0], "4 kernels, 27.4 us of kernels")
        # Longest first: the (256, 1, 1) norm 12.5; the two one-block norms 9.0 (4.50 each);
        # the embedding 5.92.
        self.assertEqual(lines[3], "| 12.5 | 1 | 12.50 | add_rms_norm_vec_kernel<2> (256, 1, 1) |")
        self.assertEqual(lines[4], "| 9.0 | 2 | 4.50 | add_rms_norm_vec_kernel<2> (1, 1, 1) |")
        self.assertEqual(lines[5], "| 5.9 | 1 | 5.92 | embedding_kernel (1, 1, 1) |")
        self.assertEqual(len(lines), 6)

    def test_unknown_unit_is_an_error(self):
        bad = "\n".join([HEADER, row(0, "k()", "(1, 1, 1)", "gpu__time_duration.sum", "cycle",
                                     "12")])
        with self.assertRaisesRegex(ValueError, "unknown time unit 'cycle' for k"):
            step_kernels.kernel_times(bad)


if __name__ == "__main__":
    unittest.main()

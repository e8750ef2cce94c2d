"""How fast one core reads memory it streams once, in 4 KiB pages and in 2 MiB (transparent huge) pages: the
ceiling of a decode step, which reads every weight once (docs/benchmarks.md, issue 25's tenth stop).

    .venv/bin/python benchmarks/read_bandwidth.py [--megabytes 540] [--repeat 6]

Compiles a small C loop (cc, -O3 -march=native) that sums a buffer with the widest vector loads, run once per page
kind in its own process; prints the best and median GB/s of each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
typedef float v16 __attribute__((vector_size(64)));
int main(int argc, char **argv) {
    const long bytes = atol(argv[1]) << 20, huge = atoi(argv[2]), repeat = atoi(argv[3]);
    const long page = 2L << 20, size = (bytes + page - 1) / page * page;
    float *a = aligned_alloc(page, size);
    if (!a) return 1;
    if (huge) madvise(a, size, MADV_HUGEPAGE); else madvise(a, size, MADV_NOHUGEPAGE);
    memset(a, 0, size);
    for (long r = 0; r < repeat; r++) {
        struct timespec t0, t1;
        v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long i = 0; i < size / 4; i += 64) {
            s0 += *(v16 *)(a + i); s1 += *(v16 *)(a + i + 16);
            s2 += *(v16 *)(a + i + 32); s3 += *(v16 *)(a + i + 48);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        v16 s = s0 + s1 + s2 + s3;
        const double seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
        printf("%.3f %g\n", size / seconds / 1e9, (double)s[0]);
    }
    return 0;
}
"""


def run(binary: Path, megabytes: int, huge: bool, repeat: int) -> list[float]:
    out = subprocess.run([str(binary), str(megabytes), str(int(huge)), str(repeat)], check=True,
                         capture_output=True, text=True).stdout
    return [float(line.split()[0]) for line in out.splitlines()][1:]  # the first pass faults the pages in


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=540, help="buffer size (default: 540, SmolLM2's float32 "
                        "weights)")
    parser.add_argument("--repeat", type=int, default=6, help="passes per page kind (default: 6)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "read.c", Path(tmp) / "read"
        source.write_text(SOURCE)
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", str(source), "-o", str(binary)],
                       check=True)
        for huge in (False, True):
            rates = sorted(run(binary, args.megabytes, huge, args.repeat + 1))
            kind = "2 MiB pages (MADV_HUGEPAGE)" if huge else "4 KiB pages (MADV_NOHUGEPAGE)"
            print(f"{kind}: best {rates[-1]:.1f} GB/s, median {rates[len(rates) // 2]:.1f} GB/s "
                  f"over {args.megabytes} MB, one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())

import sys
from megatron_pdm.stability import grid as G
from megatron_pdm.train import compare
g = G.Grid(["geo-rs"], ["stale2"], [1])
cell = g.cells()[0]
extra = sys.argv[2:]
compare.run_one("examples/tiny_cpu/config.yaml", "geo-rs", 1, sys.argv[1],
                "/tmp/gridclone/results/stability/full/warmup", g.overrides(cell) + extra, 1, 1,
                log_path=sys.argv[1] + ".log")

"""The trust-region stability benchmark: a grid of short driver runs (methods x stress settings x
seeds) from one shared warm-up, with paired comparisons (docs/stability.md)."""

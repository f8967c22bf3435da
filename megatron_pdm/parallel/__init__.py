"""torch.distributed layer: vocabulary shards and the fused vocab-parallel token-statistics op."""

from megatron_pdm.parallel.shards import ShardInfo, shard_info
from megatron_pdm.parallel.vocab_parallel import token_stats

__all__ = ["ShardInfo", "shard_info", "token_stats"]

"""(being implemented)"""


def split_kv(kv, layout):
    raise NotImplementedError


def slice_heads(shard, **kw):
    raise NotImplementedError


def merge_heads(shards, **kw):
    raise NotImplementedError

"""(being implemented)"""


def post_process(regions, block_ids, post, spec):
    raise NotImplementedError

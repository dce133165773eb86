"""(being implemented)"""


class HostStaging:
    pass

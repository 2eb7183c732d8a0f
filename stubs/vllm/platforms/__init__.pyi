class Platform:
    device_type: str
    def is_cuda_alike(self) -> bool: ...

current_platform: Platform

class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = ...) -> None: ...

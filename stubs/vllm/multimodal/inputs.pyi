class PlaceholderRange:
    offset: int
    length: int
    def __init__(self, offset: int, length: int) -> None: ...
    def get_num_embeds(self) -> int: ...

class MultiModalFeatureSpec:
    data: object | None
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    def __init__(
        self, data: None, modality: str, identifier: str, mm_position: PlaceholderRange
    ) -> None: ...

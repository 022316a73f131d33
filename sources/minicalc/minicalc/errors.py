class CalcError(Exception):
    """A syntax or evaluation error; ``column`` is 1-based, 0 when unknown."""

    def __init__(self, message: str, column: int = 0):
        super().__init__(message if not column else f"column {column}: {message}")
        self.message = message
        self.column = column

"""What a run keeps: its folder, checkpoints, books, round records, report files and warm starts."""

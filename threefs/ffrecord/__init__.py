"""FFRecord sample files: many small samples packed into a few files with an offset table, so a batch
of random samples is one batch read (docs/ffrecord.md).

    from threefs.ffrecord import FileWriter, FileReader, PackedFolder, pack_folder, dump
    from threefs.ffrecord.torch import FFRecordDataset, DataLoader      # needs torch
"""

from threefs.ffrecord.format import MAGIC, VERSION_DEFAULT, VERSIONS
from threefs.ffrecord.reader import FileReader
from threefs.ffrecord.writer import FileWriter

__all__ = ["FileReader", "FileWriter", "MAGIC", "VERSIONS", "VERSION_DEFAULT"]

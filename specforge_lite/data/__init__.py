"""Data: conversation rows -> tokenised samples with assistant-only loss masks -> batches."""

from .chat import pad_id
from .formats import MalformedRow, normalize_conversation
from .loader import Batch, BatchStream, collate
from .prepare import DataError, PreparedData, prepare_data
from .vocab import DraftVocab, build_draft_vocab

__all__ = ["Batch", "BatchStream", "DataError", "DraftVocab", "MalformedRow", "PreparedData", "build_draft_vocab",
           "collate", "normalize_conversation", "pad_id", "prepare_data"]

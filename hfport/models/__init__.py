"""One family a file; importing this package registers them all."""

from . import albert, bert, distilbert, roberta, xlm_roberta  # noqa: F401
from . import deberta_v2  # noqa: F401

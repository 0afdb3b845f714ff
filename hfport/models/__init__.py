"""One family a file; this table is the list of them (hfport.registry reads it)."""

from .albert import ALBERT
from .bert import BERT
from .deberta_v2 import DEBERTA_V2
from .distilbert import DISTILBERT
from .family import Family
from .modernbert import MODERNBERT
from .roberta import ROBERTA
from .xlm_roberta import XLM_ROBERTA

# issue 33: MPNet, ELECTRA, CamemBERT
from .camembert import CAMEMBERT
from .electra import ELECTRA
from .mpnet import MPNET

FAMILIES: dict[str, Family] = {f.model_type: f for f in (BERT, ROBERTA, XLM_ROBERTA, DISTILBERT, ALBERT, DEBERTA_V2,
                                                            MODERNBERT)}
# issue 33's families, a block of their own
FAMILIES.update({f.model_type: f for f in (MPNET, ELECTRA, CAMEMBERT)})

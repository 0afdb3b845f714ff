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

# the rotary families (issue 33)
from .eurobert import EUROBERT
from .gte import GTE
from .jina_embeddings_v3 import JINA_EMBEDDINGS_V3
from .nomic_bert import NOMIC_BERT

FAMILIES: dict[str, Family] = {f.model_type: f for f in (BERT, ROBERTA, XLM_ROBERTA, DISTILBERT, ALBERT, DEBERTA_V2,
                                                            MODERNBERT, MPNET, ELECTRA, CAMEMBERT,
                                                            GTE, NOMIC_BERT, EUROBERT, JINA_EMBEDDINGS_V3)}

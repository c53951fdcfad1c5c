"""The document-balanced layout's runs: ``tries`` (the entry points and the tries), ``design`` (the
slots of one try's design), ``work`` (the work model and bookkeeping), ``search`` (the contiguous
balancer's local search), ``bound`` (a floor on the K/V rows any layout within a balance ships).
"""

"""Dataset adapters: upstream's template (:mod:`.base`), its hub datasets (:mod:`.upstream`) and local data (:mod:`.local`)."""

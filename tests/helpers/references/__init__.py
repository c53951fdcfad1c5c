"""Independent ground truth: attention as float64 autograd math (:mod:`.attention`), packed documents and sliding
windows as float64 masked attention (:mod:`.masks`), and the mask cases run through the hybrid attention against it
(:mod:`.mask_cases`)."""

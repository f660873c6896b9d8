"""What the network sees: loaders under DDP, the train data, validation splits, batches,
bad samples named, random number generators."""

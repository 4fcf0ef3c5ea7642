"""pipeshard.partitioner"""

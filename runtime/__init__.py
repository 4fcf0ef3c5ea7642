"""pipeshard.runtime"""

"""pipeshard.profiles"""

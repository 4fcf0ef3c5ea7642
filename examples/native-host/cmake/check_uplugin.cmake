# unreal_syntax_check's last step: Pipeshard.uplugin is JSON naming the Pipeshard runtime module.
#   cmake -DPLUGIN=unreal/Pipeshard.uplugin -P check_uplugin.cmake
file(READ ${PLUGIN} plugin)
string(JSON name ERROR_VARIABLE error GET "${plugin}" Modules 0 Name)
if(error OR NOT name STREQUAL "Pipeshard")
  message(FATAL_ERROR "${PLUGIN}: no Pipeshard module (${error})")
endif()
string(JSON type GET "${plugin}" Modules 0 Type)
message(STATUS "${PLUGIN}: module ${name} (${type})")
